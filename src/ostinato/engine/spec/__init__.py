"""Speculative decoding: proposers, verification of drafts, self-draft graphs, and the
verify-ahead loop."""
