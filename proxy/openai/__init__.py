"""OpenAI's completions and chat completions, and vLLM's tokenize and detokenize: the request
bodies (`schemas`) and their tools (`tool_requests`), the routes (`completions`, `tokenize`), and
the answer (`completion_answer`, its stream chunks in `chunks`, its tool calls in `chat_tools`).
The Responses and Messages surfaces build on its request types and tools.
"""
