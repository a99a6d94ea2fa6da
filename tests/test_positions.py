"""Property tests of every registered position codec, and of domains, identities and tokens."""

import functools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faucet_dagster.protocol import (
    CommitToken,
    DataError,
    EventIdentity,
    FaucetError,
    IncarnationChanged,
    IntegrityError,
    OrderingDomain,
    Position,
    PositionCodec,
    compare_positions,
    default_codec_registry,
)

REGISTRY = default_codec_registry()
CODEC_NAMES = REGISTRY.names()

NATIVE_POSITIONS: dict[str, st.SearchStrategy[Any]] = {
    "nats.stream_sequence": st.integers(min_value=1, max_value=2**63 - 1),
    "kafka.offset": st.integers(min_value=0, max_value=2**63 - 1),
    "postgres.lsn": st.one_of(
        st.integers(min_value=0, max_value=2**64 - 1),
        st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)).map(
            lambda hl: f"{hl[0]:x}/{hl[1]:08X}"
        ),
    ),
}
MALFORMED = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(),
    st.integers(max_value=-1),
    st.lists(st.integers(), max_size=2),
    st.text().filter(lambda text: not text.isdigit() and "/" not in text),
    st.just(""),
    st.just("-1"),
    st.just("01"),
    st.just("1/2/3"),
    st.just("G/0"),
)


def test_every_connector_codec_is_registered() -> None:
    assert set(CODEC_NAMES) >= set(NATIVE_POSITIONS)
    assert set(NATIVE_POSITIONS) >= set(CODEC_NAMES), "a registered codec has no property test"


def positions_for(name: str) -> st.SearchStrategy[Any]:
    codec = REGISTRY.get(name)
    return NATIVE_POSITIONS[name].map(codec.validate)


@functools.cache
def codec(name: str) -> PositionCodec[Any]:
    return REGISTRY.get(name)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_codec_name_matches_registration(name: str) -> None:
    assert codec(name).name == name


@pytest.mark.parametrize("name", CODEC_NAMES)
@given(data=st.data())
def test_compare_is_a_total_order_consistent_with_canonicalize(name: str, data: st.DataObject) -> None:
    c = codec(name)
    a, b, x = (data.draw(positions_for(name)) for _ in range(3))
    # Consistent with canonical equality.
    assert (c.compare(a, b) == 0) == (c.canonicalize(a) == c.canonicalize(b))
    # Antisymmetric and reflexive.
    assert c.compare(a, a) == 0
    assert (c.compare(a, b) > 0) == (c.compare(b, a) < 0)
    # Transitive.
    if c.compare(a, b) <= 0 and c.compare(b, x) <= 0:
        assert c.compare(a, x) <= 0
    # Canonical strings round-trip to the same position.
    assert c.compare(c.validate(c.canonicalize(a)), a) == 0
    assert c.canonicalize(c.validate(c.canonicalize(a))) == c.canonicalize(a)


@pytest.mark.parametrize("name", CODEC_NAMES)
@given(raw=MALFORMED)
def test_validate_rejects_malformed_input_with_a_faucet_error(name: str, raw: object) -> None:
    with pytest.raises(DataError) as caught:
        codec(name).validate(raw)
    assert name in str(caught.value)


def test_integer_codecs_reject_below_their_minimum() -> None:
    with pytest.raises(DataError):
        codec("nats.stream_sequence").validate(0)
    assert codec("kafka.offset").validate(0) == 0


PAST_THE_RANGE: dict[str, st.SearchStrategy[Any]] = {
    "nats.stream_sequence": st.integers(min_value=2**63, max_value=2**80),
    "kafka.offset": st.integers(min_value=2**63, max_value=2**80),
    "postgres.lsn": st.one_of(
        st.integers(min_value=2**64, max_value=2**80),
        st.integers(min_value=2**32, max_value=2**40).map(lambda high: f"{high:X}/0"),
    ),
}


@pytest.mark.parametrize("name", CODEC_NAMES)
@given(data=st.data())
def test_codecs_refuse_positions_past_their_types_range(name: str, data: st.DataObject) -> None:
    """A Kafka offset and a JetStream sequence are int64 (what every store keeps a position as), an
    LSN uint64: one past that range is refused where it enters, as a native value and as text."""
    raw = data.draw(PAST_THE_RANGE[name])
    for form in (raw, str(raw)) if isinstance(raw, int) and name != "postgres.lsn" else (raw,):
        with pytest.raises(DataError, match=name):
            codec(name).validate(form)


def test_lsn_canonical_form_is_what_postgres_prints() -> None:
    lsn = codec("postgres.lsn")
    assert lsn.canonicalize(lsn.validate("16/b374d848")) == "16/B374D848"
    assert lsn.canonicalize(lsn.validate("0/0")) == "0/0"
    assert lsn.compare(lsn.validate("1/0"), lsn.validate("0/FFFFFFFF")) > 0


def domain(incarnation: str, codec_name: str = "kafka.offset", partition: str = "0") -> OrderingDomain:
    return OrderingDomain("kafka", "orders", partition, incarnation, codec_name)


@given(
    a=st.integers(0, 10**9), b=st.integers(0, 10**9), first=st.text(min_size=1), second=st.text(min_size=1)
)
def test_positions_of_different_incarnations_never_compare(a: int, b: int, first: str, second: str) -> None:
    left = Position(domain(first), str(a))
    right = Position(domain(second), str(b))
    if first == second:
        assert (compare_positions(left, right) < 0) == (a < b)
        return
    with pytest.raises(IncarnationChanged):
        compare_positions(left, right)
    with pytest.raises(IncarnationChanged):
        _ = left < right


def test_positions_of_different_domains_never_compare() -> None:
    with pytest.raises(IntegrityError):
        compare_positions(
            Position(domain("i", partition="0"), "1"), Position(domain("i", partition="1"), "1")
        )


def test_event_identity_is_stable_and_independent_of_the_run() -> None:
    first = EventIdentity(domain("topic-id-1"), "42", 0)
    again = EventIdentity(domain("topic-id-1"), "42", 0)
    assert str(first) == str(again) and first.digest() == again.digest()
    assert len(first.digest()) == 32
    assert EventIdentity(domain("topic-id-1"), "42", 1).digest() != first.digest()
    assert EventIdentity(domain("topic-id-2"), "42", 0).digest() != first.digest()


@given(a=st.integers(0, 10**20 - 1), b=st.integers(0, 10**20 - 1))
def test_commit_tokens_sort_as_strings_like_their_numbers(a: int, b: int) -> None:
    left, right = CommitToken(a), CommitToken(b)
    assert len(str(left)) == CommitToken.WIDTH
    assert (str(left) < str(right)) == (left < right) == (a < b)
    assert CommitToken.parse(str(left)) == left


@pytest.mark.parametrize("bad", ["", "12", "x" * 20, "-" + "1" * 19])
def test_commit_token_parse_rejects_malformed(bad: str) -> None:
    with pytest.raises(FaucetError):
        CommitToken.parse(bad)


def test_commit_token_rejects_out_of_range() -> None:
    with pytest.raises(DataError):
        CommitToken(-1)
    with pytest.raises(DataError):
        CommitToken(10**20)
