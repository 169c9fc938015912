"""What only the tests use inside the library: :mod:`.faults` (``OAR_FAULTS``), the fault
injector whose hook points (:func:`.faults.inject`) sit in the trainer, the checkpoint writer
and the weight sync; unset in normal runs."""
