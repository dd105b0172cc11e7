"""OpenAI's Responses API and its Conversations API: the request bodies (`request`) and input
items (`input_items`, `item_references`), the Response object (`response_object`) and its events
(`events`), the routes (`routes`), background responses (`background`, `event_history`), and
conversations (`conversations`). The daemon's store keeps what they name.
"""
