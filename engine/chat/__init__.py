"""The chat layer below the integrations: conversations in, rendered prompts out."""
from .prompt import ChatPrompt, render_chat_prompt

__all__ = ["ChatPrompt", "render_chat_prompt"]
