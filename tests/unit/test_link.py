"""Emulated slow links: the sleep charged for a known collective equals the formula."""
import pytest

from meshtrain.core.comm import ring_all_reduce_elements, ring_all_reduce_received_elements
from meshtrain.core.link import EMULATION_LABEL, LinkModel, LinkSpecError, parse_link_spec


def test_sleep_charged_equals_formula():
    slept = []
    model = LinkModel.from_spec("dp=1Gb/s,5ms; tp=100GB/s", sleep=slept.append)
    assert model.links["dp"].bandwidth == 1.25e8 and model.links["dp"].latency == 0.005
    numel, n, r, size = 1_000_000, 4, 1, 4   # a 4 MB fp32 gradient on a ring of 4
    sent = ring_all_reduce_elements(numel, n, r) * size
    received = ring_all_reduce_received_elements(numel, n, r) * size
    assert sent == 2 * (n - 1) * numel // n * size   # 6 MB: the ring factor 2(N-1)/N
    model.charge("dp", "all_reduce", sent, received, n)
    assert slept == [pytest.approx(2 * (n - 1) * 0.005 + 6e6 / 1.25e8)]   # 0.03 + 0.048 s
    model.charge("dp", "all_gather", 3_000_000, 3_000_000, n)
    assert slept[-1] == pytest.approx((n - 1) * 0.005 + 3e6 / 1.25e8)
    model.charge("pp", "send", 1000, 0, 2)           # no link on pp: nothing slept
    assert len(slept) == 2
    assert model.charged["dp"] == pytest.approx(sum(slept))
    assert model.describe().startswith(EMULATION_LABEL)


@pytest.mark.parametrize("spec, words", [
    ("xp=1Gb/s", "unknown axis 'xp'"),
    ("dp=fast", "does not start with a number"),
    ("dp=1GHz", "is not a rate"),
    ("dp=1Gb/s,5parsecs", "latency '5parsecs' is not a time"),
    ("dp", "has no '='"),
    ("dp=1Gb/s;dp=2Gb/s", "given twice"),
    ("", "is empty"),
])
def test_bad_link_spec_names_the_problem(spec, words):
    with pytest.raises(LinkSpecError) as e:
        parse_link_spec(spec)
    assert words in str(e.value)
