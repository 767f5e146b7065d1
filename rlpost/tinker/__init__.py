"""The Tinker training API, served locally: a face over :mod:`rlpost.api` (docs/tinker.md)."""
