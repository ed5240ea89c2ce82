"""The decode-step cost model (docs/cost_model.md): :mod:`~bench.cost.hardware` profiles,
:mod:`~bench.cost.shapes` model dimensions, :mod:`~bench.cost.formulas` floors and projections,
:mod:`~bench.cost.tables` Markdown tables and the validation against published figures."""
