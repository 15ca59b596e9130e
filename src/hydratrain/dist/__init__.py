"""Where this process sits in the job (:mod:`.env`), its process group (:mod:`.process_group`), small collectives
(:mod:`.collectives`) and the run dir all ranks share (:mod:`.run_dir`)."""
