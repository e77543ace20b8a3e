"""Alpaca-like instructions as text: short tasks of the kind the Alpaca dataset holds (explain,
list, rewrite, classify, compute, write a little), written for this package.

Why text and not the workloads' lengths: :mod:`pagedkv.bench.workloads` draws Alpaca-like
*lengths* (mean 19 prompt tokens) and the throughput benchmarks fill them with random token ids,
which costs the same to run. A measurement of what a model *says* (the fp8 accuracy benchmark,
:mod:`pagedkv.bench.fp8_accuracy`) needs prompts a model answers in earnest: these 64, put in
the model's chat template. Their token counts are Alpaca-like too (a dozen words each).
"""

from __future__ import annotations

__all__ = ["ALPACA_LIKE_INSTRUCTIONS", "alpaca_like_instructions"]

ALPACA_LIKE_INSTRUCTIONS: tuple[str, ...] = (
    "Give three tips for staying focused while studying.",
    "Explain why the sky looks blue during the day.",
    "Name the largest ocean on Earth and one animal that lives in it.",
    "Write a short poem about autumn leaves.",
    "Describe how a bicycle converts pedaling into motion.",
    "List four fruits that are rich in vitamin C.",
    "Rewrite this sentence in the passive voice: The cat chased the mouse.",
    "What is the difference between weather and climate?",
    "Suggest a name for a bakery that sells only bread.",
    "Explain what a prime number is to a ten-year-old.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Classify these animals as mammals or birds: eagle, whale, penguin, bat.",
    "Translate 'Good morning, how are you?' into French.",
    "Give an example of a renewable source of energy and explain how it works.",
    "Write a friendly email inviting a colleague to lunch on Friday.",
    "What are the main causes of inflation?",
    "Compute the area of a rectangle that is 7 meters long and 4 meters wide.",
    "Describe the water cycle in a few sentences.",
    "List three benefits of regular exercise.",
    "Explain the purpose of a firewall in computer networks.",
    "Create a short story opening that starts on a train at night.",
    "What is photosynthesis and why is it important?",
    "Suggest three ways to reduce plastic waste at home.",
    "Explain the rules of tic-tac-toe.",
    "Convert 100 degrees Fahrenheit to Celsius and show the steps.",
    "Describe the taste of a lemon to someone who has never had one.",
    "Give two arguments for and two against working from home.",
    "Write a haiku about the ocean.",
    "Explain what a black hole is in simple terms.",
    "List the planets of the solar system in order from the Sun.",
    "What does a good night's sleep do for the brain?",
    "Write a product description for a reusable water bottle.",
    "Explain the difference between a virus and a bacterium.",
    "Suggest a weekend itinerary for a first visit to Rome.",
    "Describe how to make a cup of green tea.",
    "Why do leaves change color in the fall?",
    "Write a motivational quote for someone starting a new job.",
    "Explain what an API is, with an everyday analogy.",
    "Find the next number in the sequence 2, 4, 8, 16.",
    "Describe the main features of a desert ecosystem.",
    "Give three tips for writing a clear paragraph.",
    "Explain how vaccines help the immune system.",
    "Write a tweet announcing the opening of a new library.",
    "What are the primary colors, and how are secondary colors made?",
    "Explain the concept of supply and demand.",
    "Create a list of five questions to ask in a job interview.",
    "Describe the life cycle of a butterfly.",
    "Explain why we have seasons on Earth.",
    "Suggest a healthy breakfast that takes less than ten minutes to make.",
    "What is the function of the heart in the human body?",
    "Write a short dialogue between a customer and a waiter.",
    "Explain what recycling is and why it matters.",
    "Give an example of a metaphor and explain its meaning.",
    "Describe three ways to save energy in an office.",
    "Explain how a rainbow forms.",
    "List four common symptoms of the flu.",
    "Write a thank-you note to a teacher.",
    "What is the boiling point of water at sea level, and why does it change on mountains?",
    "Explain the difference between a simile and a metaphor.",
    "Suggest three board games for a family evening and say why.",
    "Describe what a computer's memory does.",
    "Explain what gravity is in one paragraph.",
    "Write instructions for planting a tomato seed.",
    "Give two reasons why reading books is valuable.",
)


def alpaca_like_instructions(count: int) -> list[str]:
    """The first ``count`` instructions (``1 <= count <= 64``)."""
    if not 1 <= count <= len(ALPACA_LIKE_INSTRUCTIONS):
        raise ValueError(
            f"there are {len(ALPACA_LIKE_INSTRUCTIONS)} Alpaca-like instructions; ask for 1 to "
            f"{len(ALPACA_LIKE_INSTRUCTIONS)} (got {count})"
        )
    return list(ALPACA_LIKE_INSTRUCTIONS[:count])
