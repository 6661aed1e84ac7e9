"""The dashboard's static files (``index.html``, ``dashboard.js``, ``wire.js``, ``dashboard.css``), served at
``/ui`` by ``gateway.http.routes.ui``.
A package only so that setuptools ships the folder as package data; no code here."""
