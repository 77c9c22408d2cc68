"""Speculative decoding: proposers, verification of drafts, and self-draft graphs."""
