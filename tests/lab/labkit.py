"""Constants of the lab tests (imported by conftest and the tests: tests/lab is on the path)."""

from workbench.policy.costmodel import CostModel, LinearCost

SHAPE = (5, 4, 16)
MAX_NEW = 40
# A fixed cost model (ms): replay tests assert behaviour, not this machine's speed.
COST = CostModel(target=LinearCost(5.0, 0.25, 0.5), draft=LinearCost(0.6, 0.05),
                 plain_overhead=LinearCost(0.5, 0.05), spec_overhead=LinearCost(2.0, 0.2))
