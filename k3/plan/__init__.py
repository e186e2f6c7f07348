"""`k3 plan`: what it takes to train or serve a model at cluster scale, on paper (`plan_training`,
`plan_serving`), checked against published figures (`k3.plan.published`) and against torch's own
sharding of the model on the meta device (`k3.plan.simulate`)."""

from .figures import Figures
from .hardware import GPUS, Gpu
from .shapes import Layout, model_shapes, rank_values
from .training import TrainSettings, plan_training

__all__ = ["Figures", "GPUS", "Gpu", "Layout", "model_shapes", "rank_values", "TrainSettings", "plan_training"]
