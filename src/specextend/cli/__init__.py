"""The command line: `specextend` and its commands (`main`), the side-by-side demonstration
(`demo`), and docs/cli.md written from the parsers (`doc`)."""
