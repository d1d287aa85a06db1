"""What every layer uses: atomic writes, bounds on user input, progress steps, tables, plots, errors the CLI
prints as one line, and lazy package attributes."""
