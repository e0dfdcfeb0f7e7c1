"""The distributed job: process groups (:mod:`.process_groups`), the sharded optimizer
state (:mod:`.dist_optimizer`), a dead or hung rank (:mod:`.faults`), SIGINT and SIGTERM
across ranks (:mod:`.signals`), and torchrun itself (:mod:`.torchrun`, :mod:`.local`)."""
