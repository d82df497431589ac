"""Tools on top of the library: profile, bench and its report, timing, the CLI, the demo."""
