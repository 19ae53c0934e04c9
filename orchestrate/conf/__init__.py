# orchestrate's configs, a package so that Hydra (pkg://orchestrate.conf) and the wheel find them.
