"""The results page's words come from k3/lab/templates/*.md, filled from a run's own numbers: a fixed, made-up
measurement rendered through them gives the page's sentences, and no template tells of earlier runs."""

from importlib import resources

import pytest

from k3.lab import recall
from k3.lab.report import HEADER, Claim, Result
from k3.lab.text import paragraph, sections, text


def _fake_disagreements():
    plan = recall.PLANS["quick"]
    d = max(plan.head_dims)
    pairs = plan.pairs(d)
    scores = {
        "deltanet": {p: 0.9 if p <= d else 0.3 for p in pairs},
        "linear_attn": {p: 0.8 if p <= d else 0.25 for p in pairs},
    }
    claims = [Claim("The delta rule overwrites instead of piling up, so DeltaNet retrieves more", "-", "partly")]
    probes = {("elu_linear_attn", 0): {"accuracy": {p: 0.125 for p in pairs}}}
    filler = {
        m: {"pairs": d, "long": 4 * plan.span * d, "filler": f, "no filler": 0.95}
        for m, f in (("linear_attn", 0.2), ("deltanet", 0.75))
    }
    return d, recall.disagreements(claims, scores, d, plan, probes, filler)


def test_a_fixed_measurement_renders_the_pages_sentences(tmp_path):
    d, notes = _fake_disagreements()
    result = Result(
        name="recall", title="Associative recall", mode="quick", command="k3 lab recall --quick", notes=notes
    )
    page = result.markdown()
    assert (
        "- Disagreement — DeltaNet against linear attention. Published: DeltaNet's paper (Yang et al. 2024) "
        "reports near-perfect MQAR"
    ) in page
    assert (
        "The table itself: at or below D pairs DeltaNet answers 90% and linear attention 80%; past D 30% and 25%."
        in page
    )
    assert (
        "Linear attention as the article writes it (ELU+1 features, a normaliser, no short convolution), trained "
        "the same way: 12% at or below D pairs, 12% past D."
    ) in page
    assert (
        f"The difference that separates them is the filler (the probe below): {d} pairs with PAD tokens up to "
        f"T = {4 * recall.PLANS['quick'].span * d}, DeltaNet 75% and linear attention 20% (without filler 95% "
        "and 95%)."
    ) in page
    assert (
        f"- The filler probe: these models, trained without filler, answer {d} pairs at T = {4 * d} (no filler)" in page
    )
    assert "linear attention 95% without filler, 20% with it; DeltaNet 95% without filler, 75% with it." in page


def test_a_paragraph_is_one_line_and_the_header_keeps_its_lines():
    assert "\n" not in paragraph("recall", "literature")
    assert HEADER == text("report", "header") + "\n" and HEADER.startswith("# k3 lab: the article's claims")
    assert HEADER.count("\n") > 3
    with pytest.raises(KeyError, match="no section"):
        paragraph("recall", "no-such-section")


@pytest.mark.parametrize(
    "name", sorted(p.name for p in resources.files("k3.lab").joinpath("templates").iterdir() if p.name.endswith(".md"))
)
def test_templates_tell_of_this_run_only(name):
    words = resources.files("k3.lab").joinpath("templates", name).read_text(encoding="utf-8").lower()
    for history in ("previous run", "previous full", "last stop", "earlier run measured", "last run", "previous page"):
        assert history not in words, (name, history)
    assert sections(name.removesuffix(".md"))  # every file parses into sections
