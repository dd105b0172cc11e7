"""What every API surface's routes share in reading a request: its JSON body decoded into the
route's msgspec type (the error names the field as OpenAI's do: `param` from msgspec's "at
`$.field`" path, each surface's shape applied by proxy/http/errors.py; a field marked refused
in proxy/fields.py is refused here), the ids this server hands out and takes (X-Request-Id, a
path's response id), and the model a request names.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, TypeVar

import msgspec

from proxy.fields import check_refused
from proxy.http.errors import ApiError

T = TypeVar("T")

_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
_AT = re.compile(r"^(?P<what>.*?)(?: - at (?:`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>.*)`$", re.DOTALL)


def decode_body(body: bytes, struct_type: type[T]) -> T:
    """Decodes a JSON body into `struct_type`; ApiError(400) naming the field on any problem."""
    decoder = _decoders.get(struct_type)
    if decoder is None:
        decoder = _decoders[struct_type] = msgspec.json.Decoder(struct_type)
    try:
        request = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}",
                       code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    if isinstance(request, msgspec.Struct):
        check_refused(request)
    return request  # type: ignore[no-any-return]


def validation_error(text: str) -> ApiError:
    match = _AT.match(text)
    what = match.group("what") if match else text
    path = (match.group("path") or "") if match else ""
    param = path.removeprefix(".")
    missing = _MISSING.match(what)
    if missing:
        param = f"{param}.{missing.group('field')}" if param else missing.group("field")
        return ApiError(400, f"missing required field '{param}'", param=param,
                        code="missing_required_parameter")
    unknown = _UNKNOWN.match(what)
    if unknown:  # only where a type forbids unknown fields, as OpenAI does everywhere
        name = unknown.group("field")
        name = name if len(name) <= 64 else name[:64] + "..."
        param = f"{param}.{name}" if param else name
        return ApiError(400, f"Unknown parameter: '{param}'.", param=param,
                        code="unknown_parameter")
    param = param.replace("[...]", "")  # a dict's value: the field is the name
    if not param:
        return ApiError(400, f"invalid request body: {what}", code="invalid_value")
    return ApiError(400, f"invalid value for '{param}': {what}", param=param,
                    code="invalid_value")


# What a client may send as X-Request-Id, and so the form of every id this server hands out.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def check_response_id(rid: str) -> str:
    """A path's response id; one no request could have been given is refused before it is sent
    to the daemon (an id of kilobytes would not even fit in a control record)."""
    if not _REQUEST_ID.match(rid):
        shown = rid if len(rid) <= 64 else rid[:64] + "..."
        raise ApiError(400, f"invalid response id {shown!r}: ids are 1 to 128 characters of "
                       "[A-Za-z0-9._:-]", param="response_id", code="invalid_value")
    return rid


def new_id(prefix: str) -> str:
    """A request's engine key and object id: always the server's own, never a client's, so
    clients that pick the same X-Request-Id can never refuse or abort each other's work."""
    return prefix + uuid.uuid4().hex


def client_request_id(header: str | None) -> str | None:
    """The client's X-Request-Id (echoed and logged, never a key); 400 when malformed."""
    if header is not None and not _REQUEST_ID.match(header):
        raise ApiError(400, "X-Request-Id must be 1 to 128 characters of [A-Za-z0-9._:-]",
                       param="X-Request-Id", code="invalid_request_id")
    return header


def check_model(model: str | None, served: tuple[str, ...]) -> None:
    """An omitted model means the served one; any other name is a 404 as OpenAI answers."""
    if model is not None and model not in served:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{served[0]}'", param="model", code="model_not_found")
