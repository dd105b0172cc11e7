"""What the tests share: ports and polling, metrics parsing, raw HTTP and SSE clients, and the
harness that runs the real daemon and proxy. Test modules import from here, never from each other.
"""
