"""The operator's dashboard, served by the orchestrator at `/dashboard`.

HTML pages rendered on the server (Jinja2 templates), charts drawn on the server as SVG, no
script at all: the Content-Security-Policy forbids every script, so nothing in a page can read
the session or the token, and there is no JavaScript to vendor, build or keep up to date. The
pages refresh themselves with a `<meta http-equiv="refresh">`.

- `sessions`: sign-in exchanges the admin token for a session cookie; CSRF tokens;
- `overview`: what the pages show, read from the database;
- `charts`: the SVG charts;
- `routes`: the pages and the forms (sign in, sign out, pause, resume).
"""
