"""Testing helpers shipped with mok, used by its tests and its benchmark alike.

One definition of each accuracy statistic (relative L1 error, cosine), a
mismatch report that says where and by how much, seeded input generators, and the
tensors a forward context holds.
"""

from mok.testing.context import saved_tensors
from mok.testing.errors import (
    assert_close_to_reference,
    cosine_similarity,
    max_rel_err,
    mismatch_report,
    relative_error,
    TOLERANCES,
)
from mok.testing.inputs import ODD_CASES, MoEInputs, OddCase, make_inputs, make_topk_ids

__all__ = [
    "ODD_CASES",
    "TOLERANCES",
    "MoEInputs",
    "OddCase",
    "assert_close_to_reference",
    "cosine_similarity",
    "make_inputs",
    "make_topk_ids",
    "max_rel_err",
    "mismatch_report",
    "relative_error",
    "saved_tensors",
]
