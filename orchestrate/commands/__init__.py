"""The commands besides a training run (`orchestrate doctor|server|sync|up|down|slurm-ray`, named in
orchestrate.__main__): each only the command (parse its arguments, call the library, exit under
orchestrate.boundary), imported only when named."""
