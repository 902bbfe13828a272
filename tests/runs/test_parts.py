"""Checkpoint parts: a part is read back only when its name, pages and values all check out."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from trace_replay.engines.base import ReplayRequest
from trace_replay.runs.parts import PART_NAME, CorruptPart, read_part, write_part

TOP_K = 3
# trace "a": prompt of 3 tokens, then 5, 6, 7 at ranks 1, 2 and 4 (beyond the top 3);
# trace "b": prompt of 1 token, then 9 at rank 1
ROWS = [
    ("a", "da", 0, 3, 5, -0.5, 1, [5, 1, 2], [-0.5, -1.5, -3.0], 1.2),
    ("a", "da", 1, 4, 6, -1.0, 2, [8, 6, 2], [-0.6, -1.0, -3.0], 0.9),
    ("a", "da", 2, 5, 7, -2.0, 4, [1, 2, 3], [-1.2, -1.5, -1.9], 2.0),
    ("b", "db", 0, 1, 9, -0.01, 1, [9, 4, 3], [-0.01, -5.0, -6.0], 0.05),
]
COLUMNS = [
    "trace_id",
    "trace_digest",
    "step",
    "position",
    "token_id",
    "logprob",
    "rank",
    "top_token_ids",
    "top_logprobs",
    "entropy",
]
REQUESTS = {"da": ReplayRequest("a", (1, 2, 3), (5, 6, 7)), "db": ReplayRequest("b", (4,), (9,))}


@pytest.fixture
def frame() -> pd.DataFrame:
    """Two traces' rows whose steps, positions, ranks and top-k lists agree."""
    return pd.DataFrame(ROWS, columns=COLUMNS)


def test_a_part_round_trips(frame, tmp_path):
    """What write_part wrote, read_part gives back, checked against its requests and top_k."""
    path = write_part(tmp_path, frame)
    got = read_part(path, top_k=TOP_K, requests=REQUESTS)
    pd.testing.assert_frame_equal(
        got[["trace_id", "step", "token_id", "logprob", "rank"]],
        frame[["trace_id", "step", "token_id", "logprob", "rank"]],
    )
    assert np.stack(got["top_logprobs"]).tolist() == [row[8] for row in ROWS]


def test_the_name_carries_the_bytes_sha256(frame, tmp_path):
    """part-<20-digit ns>-<first 16 hex of the file's SHA-256>.parquet, with CRC'd pages."""
    path = write_part(tmp_path, frame)
    match = PART_NAME.match(path.name)
    assert match and match["sha"] == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    assert column.statistics is not None  # a real Parquet file, readable by any reader
    assert list(tmp_path.iterdir()) == [path]  # no temporary left beside it


def test_a_flipped_bit_breaks_the_name(frame, tmp_path):
    """Any changed byte: the SHA-256 no longer matches the name, and nothing is parsed."""
    path = write_part(tmp_path, frame)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPart, match="do not match the checksum in its name"):
        read_part(path)


def test_a_foreign_name_is_refused(frame, tmp_path):
    """A file not named like a part is not read as one."""
    path = write_part(tmp_path, frame)
    other = path.rename(tmp_path / "results.parquet")
    with pytest.raises(CorruptPart, match="checksum in its name"):
        read_part(other)


def test_a_damaged_page_is_caught_by_its_crc(frame, tmp_path):
    """A page changed and the name recomputed (a buggy writer): the page CRC refuses it."""
    path = write_part(tmp_path, frame)
    column = pq.ParquetFile(path).metadata.row_group(0).column(COLUMNS.index("logprob"))
    end = column.data_page_offset + column.total_compressed_size
    data = bytearray(path.read_bytes())
    data[end - 2] ^= 0xFF  # inside the logprob page's data, past its header
    sha = hashlib.sha256(bytes(data)).hexdigest()[:16]
    renamed = tmp_path / f"{path.name[:26]}{sha}.parquet"
    renamed.write_bytes(bytes(data))
    with pytest.raises(CorruptPart, match="unreadable"):
        read_part(renamed)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda f: f.drop(columns="entropy"), r"columns \['entropy'\] missing"),
        (lambda f: f.assign(step=[0, 2, 3, 0]), "steps are not 0, 1, 2"),
        (lambda f: f.assign(position=[3, 4, 6, 1]), "positions are not prompt_len \\+ step"),
        (
            lambda f: f.assign(logprob=[-0.5, np.nan, -2.0, -0.01]),
            "trace 'a', step 1: logprob nan is impossible",
        ),
        (
            lambda f: f.assign(logprob=[-0.5, -1.0, 0.5, -0.01]),
            "trace 'a', step 2: logprob 0.5 is impossible",
        ),
        (lambda f: f.assign(rank=[1, 2, 4, 0]), "trace 'b', step 0: rank 0 is impossible"),
        (
            lambda f: f.assign(entropy=[1.2, 0.9, -0.5, 0.05]),
            "trace 'a', step 2: entropy -0.5 is impossible",
        ),
    ],
)
def test_implausible_values_are_named(frame, tmp_path, edit, problem):
    """A part with a valid checksum but impossible values is refused, naming the trace, the
    step, the field and its value."""
    with pytest.raises(CorruptPart, match=problem):
        read_part(write_part(tmp_path, edit(frame)))


def test_rows_may_come_in_any_order(frame, tmp_path):
    """Steps and positions are checked per trace after sorting: shuffled rows are fine."""
    read_part(write_part(tmp_path, frame.iloc[[3, 2, 0, 1]]), top_k=TOP_K, requests=REQUESTS)


def test_top_k_lists_must_have_top_k_entries(frame, tmp_path):
    """Lists of another length than the run's top_k are refused; top_k=None skips the check."""
    path = write_part(tmp_path, frame)
    with pytest.raises(CorruptPart, match="top-k lists of the wrong length"):
        read_part(path, top_k=4)
    read_part(path, top_k=None)


def test_unsorted_top_k_is_refused(frame, tmp_path):
    """top_logprobs must descend (within the tolerance)."""
    frame.at[1, "top_logprobs"] = [-1.0, -0.2, -3.0]
    with pytest.raises(
        CorruptPart,
        match=r"step 1: top_logprobs \[-1.0, -0.2, -3.0\] is "
        "impossible: top-k logprobs are in descending order",
    ):
        read_part(write_part(tmp_path, frame), top_k=TOP_K)


@pytest.mark.parametrize("row, rank", [(0, 2), (1, 1), (2, 3)])
def test_rank_must_agree_with_top_k(frame, tmp_path, row, rank):
    """Rank r <= top_k: the r-th top logprob is the token's own; beyond: the last top logprob
    is at least the token's."""
    frame.at[row, "rank"] = rank
    with pytest.raises(
        CorruptPart,
        match=f"step {row}: rank {rank} is impossible: a rank agrees with the top-k logprobs",
    ):
        read_part(write_part(tmp_path, frame), top_k=TOP_K)


def test_tokens_must_be_the_digests_trace(frame, tmp_path):
    """Rows under a digest must carry that request's trace tokens from its prompt length."""
    other = {**REQUESTS, "da": ReplayRequest("a", (1, 2, 3), (5, 6, 8))}
    path = write_part(tmp_path, frame)
    with pytest.raises(CorruptPart, match="trace 'a', step 2: tokens differ from its digest's"):
        read_part(path, requests=other)
    longer_prompt = {**REQUESTS, "db": ReplayRequest("b", (4, 4), (9,))}
    with pytest.raises(CorruptPart, match="trace 'b'"):
        read_part(path, requests=longer_prompt)


def test_every_problem_is_named_at_once(frame, tmp_path):
    """Several problems: one error naming each of them, with its trace and first step."""
    bad = frame.assign(rank=[1, 2, 4, 0], entropy=[1.2, 0.9, -0.5, 0.05])
    with pytest.raises(
        CorruptPart,
        match="trace 'b', step 0: rank 0 is impossible: .*; "
        "trace 'a', step 2: entropy -0.5 is impossible",
    ):
        read_part(write_part(tmp_path, bad))


@pytest.mark.parametrize(
    "ids, problem",
    [
        ([8, 8, 2], "top-k token ids are distinct"),  # one alternative listed twice
        ([6, 8, 2], "top_logprobs"),  # the token listed at rank 1 with another logprob
    ],
)
def test_read_back_applies_the_top_k_id_rules(frame, tmp_path, ids, problem):
    """A part is held to every rule an engine's result is: the top-k token ids too (distinct,
    and a listed token carries its own logprob), not only the logprobs and ranks."""
    frame.at[1, "top_token_ids"] = ids
    with pytest.raises(CorruptPart, match=problem):
        read_part(write_part(tmp_path, frame), top_k=TOP_K)


def test_a_frame_is_checked_as_its_part_read_back_is(frame, tmp_path):
    """check_rows gives the same verdict on the frame an engine call built (top-k cells are
    lists) as on its part read back (cells are arrays), shuffled rows and traces included."""
    from trace_replay.runs.parts import check_rows

    other = {**REQUESTS, "da": ReplayRequest("a", (1, 2, 3), (5, 9, 7))}
    bad = frame.assign(rank=[1, 2, 4, 0]).iloc[[2, 3, 0, 1]]
    back = pd.read_parquet(write_part(tmp_path, bad))
    assert isinstance(bad["top_logprobs"].iloc[0], list)
    assert isinstance(back["top_logprobs"].iloc[0], np.ndarray)
    for rows in (bad, back):
        assert check_rows(rows, top_k=TOP_K, requests=other) == {
            "a": ["step 1: tokens differ from its digest's"],
            "b": ["step 0: rank 0 is impossible: a rank is an integer >= 1"],
        }
