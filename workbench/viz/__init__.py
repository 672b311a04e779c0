"""Visualization: trace DataFrames → plotly figures (``figures``) and ipywidgets panels
(``widgets``). The models the notebooks run on are built by :mod:`workbench.train.demo_models`.

Import the submodules directly (``from workbench.viz import figures``): plotly and ipywidgets
are only needed by the notebooks extra, so importing ``workbench`` never pulls them in.
"""

from __future__ import annotations
