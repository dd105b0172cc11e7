"""The HTTP edge every API surface shares: the connection's protocol and its limits
(`protocol`), the API-key check (`auth`), refusals as `ApiError` and their shapes (`errors`), SSE
framing (`sse`), the watch on a client leaving (`cancellation`), and whose request it is to the
store (`tenancy`). It knows no surface and no engine.
"""
