"""Speculative decoding's pure building blocks: the n-gram proposer and the rejection sampler.

Not yet wired into the engine (issue #41): nothing here schedules draft tokens, runs a
verification step or frees the KV slots of rejected tokens.
"""

from attnserve.spec_decode.ngram import propose_ngram, propose_ngram_reference
from attnserve.spec_decode.rejection import PLACEHOLDER_TOKEN_ID, RejectionOutput, rejection_sample

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RejectionOutput",
    "propose_ngram",
    "propose_ngram_reference",
    "rejection_sample",
]
