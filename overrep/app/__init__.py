"""The application: typed config, the run pipeline, its output folder, compare, reports, export and the command line (the only place with argparse)."""
