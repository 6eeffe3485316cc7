"""The kernel below every layer: errors, file I/O and the ledger of evaluation records."""
