"""Chat records for supervised fine-tuning: a record's conversation (:mod:`.records`) rendered with the model's chat
template and masked to the turns it trains on (:mod:`.encoder`); the Tokenize node runs it when
``TokenizeOptions(chat=ChatOptions(...))`` is set, so workers, batching, exact resume and errors are the text stage's.
"""

from streampack.chat.encoder import ChatEncoder
from streampack.chat.records import Conversation, conversation

__all__ = ["ChatEncoder", "Conversation", "conversation"]
