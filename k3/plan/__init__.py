"""`k3 plan`: what it takes to train or serve a model at cluster scale, on paper
(`k3.plan.training.plan_training`, `k3.plan.serving.plan_serving`), checked against published figures
(`k3.plan.published`) and against torch's own sharding of the model on the meta device
(`k3.plan.simulate`).

Modules: `hardware` (the GPU table), `shapes` (parameter shapes and the per-rank shards of k3's FSDP2 +
expert-parallel layout), `costs` (FLOPs and activation bytes per token), `training`, `serving`,
`published`, `simulate`, `figures` (a plan's figures with their units) and `commands` (`k3 plan`'s
arguments). Nothing is imported here, so that `k3 --help` does not load torch.
"""
