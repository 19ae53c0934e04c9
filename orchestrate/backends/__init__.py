"""Training backends. A backend is one file here plus one `conf/backend/<name>.yaml` whose
`_target_` names its class; nothing else lists them. See `base.Backend` for the interface."""
