"""Other serving engines driven from the workbench: SGLang on the GPU box — the launch
(:mod:`~workbench.remote.launch`, policies → adaptive tiers in
:mod:`~workbench.remote.adaptive`), the client (:mod:`~workbench.remote.sglang`, same trace
schema), its per-request records (:mod:`~workbench.remote.records`) and the box's threshold
sweep (:mod:`~workbench.remote.crossover`)."""
