"""``quiet_progress`` reaches every trainer module that shows a tqdm bar (the trainers import
``tqdm`` by name, so a module split out of a trainer must be silenced too)."""

from __future__ import annotations

import importlib
import pkgutil

import workbench.train as train
from workbench.train.demo_models import quiet_progress


def test_quiet_progress_silences_every_trainer_module() -> None:
    modules = [importlib.import_module(m.name)
               for m in pkgutil.walk_packages(train.__path__, "workbench.train.")]
    with_bars = [m for m in modules if "tqdm" in vars(m)]
    assert {m.__name__ for m in with_bars} >= {"workbench.train.target",
                                               "workbench.train.eagle3.data",
                                               "workbench.train.eagle3.trainer"}
    before = {m.__name__: m.tqdm for m in with_bars}
    with quiet_progress():
        for m in with_bars:
            bar = m.tqdm(range(3))
            assert bar.disable, f"{m.__name__}: its tqdm bar still shows"
            bar.close()
    assert {m.__name__: m.tqdm for m in with_bars} == before
