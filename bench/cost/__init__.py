"""The decode-step cost model (docs/cost_model.md): :mod:`~bench.cost.hardware` profiles,
:mod:`~bench.cost.shapes` model dimensions, :mod:`~bench.cost.formulas` floors and projections,
:mod:`~bench.cost.efficiency` kernel efficiencies measured on one H200 (the calibration),
:mod:`~bench.cost.tables` Markdown tables, memory per rank and the validation against published figures."""
