"""One request from decoded body to runner and back: defaults, context fit, replica, queue, stream, resume."""
