"""What both planes share: the queue entry, sampling fields, constraints, output rows, named errors."""
