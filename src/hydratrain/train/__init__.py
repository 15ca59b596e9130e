"""The training loop (:mod:`.trainer`), what it logs (:mod:`.step_logger`) and what a run leaves behind
(:mod:`.outputs`)."""
