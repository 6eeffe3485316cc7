"""Performance scripts: each prints ratios measured side by side in one run (docs/guide/performance.md).
They are tools at the top of the layers, like the CLI: they may time any part."""
