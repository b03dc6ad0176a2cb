"""Helpers the tests share: one place, so no test file imports from another."""
