"""Other serving engines driven from the workbench: SGLang on the GPU box — the launch
(:mod:`~workbench.backends.launch`, policies → adaptive tiers in
:mod:`~workbench.backends.adaptive`), the client (:mod:`~workbench.backends.sglang`, same trace
schema), its per-request records (:mod:`~workbench.backends.records`) and the box's threshold
sweep (:mod:`~workbench.backends.box`)."""
