"""Where runs run and report: Ray (start, join, access, placement: `ray_cluster`), the warm local
stack's record and processes (`warm`), the MLflow server process (`mlflow_server`), Ray across a
Slurm allocation (`allocation`), and ports (`ports`)."""
