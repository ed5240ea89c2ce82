"""What ``docs/metrics.md`` says of a ``/metrics`` page: every sample's family has a row, and every value of an
enumerated label (``state``, ``tier``, ``how``, ``reason``, …) is named in that row, in backticks."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import REPO_ROOT

# labels whose values are not an enumeration: indices, the served name, histogram bounds
FREE_LABELS = {"model_name", "engine", "dp_rank", "rank", "layer", "le", "quantile", "gpu", "step_kind_index"}
FREE_TEXT = {("switchyard:eager_steps", "reason")}  # a sentence saying why a step ran eagerly


def doc_rows(text: str | None = None) -> dict[str, str]:
    """Metric name (as documented: counters with ``_total``) → its table row in ``docs/metrics.md``."""
    text = text if text is not None else (REPO_ROOT / "docs" / "metrics.md").read_text()
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `((?:vllm|switchyard):[a-z0-9_]+)` \|.*$", text,
                                                          flags=re.M)}


def undocumented(page: str, rows: dict[str, str] | None = None) -> list[str]:
    """The samples of ``page`` whose family or enumerated label value ``docs/metrics.md`` does not name."""
    rows = rows if rows is not None else doc_rows()
    missing = set()
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            row = rows.get(s.name) or rows.get(family.name) or rows.get(family.name + "_total")
            if row is None:
                missing.add(f"{s.name}: no row")
                continue
            for key, value in s.labels.items():
                free = key in FREE_LABELS or (family.name, key) in FREE_TEXT
                if free or re.fullmatch(r"[0-9.+-]+(e[0-9+-]+)?|inf|\+Inf", value):
                    continue
                if f"`{value}`" not in row:
                    missing.add(f"{s.name}{{{key}=\"{value}\"}}: value not in its row")
    return sorted(missing)


def assert_documented(page: str) -> None:
    """Fails listing every sample of ``page`` that :func:`undocumented` finds."""
    missing = undocumented(page)
    assert not missing, "docs/metrics.md does not name:\n" + "\n".join(missing)
