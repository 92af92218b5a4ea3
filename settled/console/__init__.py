"""The support console: a server-rendered web page where support staff work the review queue.

Mounted by ``settled web`` under ``/console`` beside the status API. ``auth`` signs staff in
(accounts, sessions, CSRF, throttling); the pages use the same service layer as the CLI
(``support.review``).
"""
