"""``python -m keyserial.postgres setup DSN``: make the fence sequence (see ``setup_sql``)."""

from ._setup import main

main()
