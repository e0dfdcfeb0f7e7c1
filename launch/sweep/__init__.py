"""``hla-sp sweep CONFIG``: Ray Train grids (:mod:`.ray_sweep`) over the sweep file's
points (:mod:`.sweep_config`)."""
