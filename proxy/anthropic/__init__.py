"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), the API
Claude Code speaks, in one room: the request bodies (`request`), their translation into the
engine's chat Submit (`translate`), the message and its stream of events (`answer`), errors in
Anthropic's shape and statuses (`errors`), and the routes (`routes`), which serve a message
through the chat path's exchange.
"""
