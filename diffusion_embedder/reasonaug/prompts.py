"""Prompt templates of the ReasonAug pipeline, reproducing the upstream GPT-4o-mini batch requests.

``definition_prompt`` and ``problem_prompt`` regenerate the shared batch inputs byte for byte (tested on
all 300 + 2,400 real requests); the check and hard-negative prompts follow the upstream scripts. The one
deliberate change is the ``p2i`` instruction, where upstream's "Gievn" typo is fixed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFINITION_SYSTEM = "You are a helpful assistant."
PROBLEM_SYSTEM = "You are an expert in drafting novel problems and solutions."
SOLUTION_CHECK_SYSTEM = "You are an expert in solving problems."
NEGATIVE_SYSTEM = "You are an expert for generating hard negative document for information retrieval tasks."

DEFINITION_MAX_TOKENS = 1000
PROBLEM_MAX_TOKENS = 4000

QUESTION_TYPES = {
    "algorithm": "coding",
    "data structure": "coding",
    "math theorem": "math",
    "physics theorem": "physics",
    "finance formula": "finance",
}

_CODING_REFS = [
    "LeetCode",
    "Advanced Placement (AP) Computer Science Exams",
    "ACM ICPC (International Collegiate Programming Contest)",
    "Google Code Jam",
    "Codeforces Contests",
    "HackerRank",
    "Google Kick Start",
]
DIFFICULTY_REFERENCES = {
    "algorithm": _CODING_REFS,
    "data structure": _CODING_REFS,
    "math theorem": [
        "American Mathematics Competitions",
        "American Invitational Mathematics Examination",
        "International Mathematical Olympiad",
        "China's GaoKao Math Problems",
        "Scholastic Assessment Test Math Exam",
        "Putnam Competition",
    ],
    "physics theorem": [
        "International Physics Olympiad (IPhO)",
        "Physics Bowl",
        "American Invitational Physics Exam (AIPMT)",
        "International A-Level Physics Exam",
        "Scholastic Assessment Test (SAT) Physics Subject Test",
        "China's GaoKao Physics Problems",
    ],
    "finance formula": [
        "CFA (Chartered Financial Analyst) Exam",
        "MBA Finance Entrance Exams",
        "Graduate Management Admission Test",
        "FRM (Financial Risk Manager) Exam",
    ],
}

# Upstream's wording, typos included ("fiance"), so the real requests are reproduced exactly.
CODING_CONTEXTS = [
    "The problem should be based on real world human activities.",
    "The problem should be based on a theoretical coding context.",
    "The problem should be about a company or a factory.",
    "The problem should be about a game or a puzzle.",
    "The problem should be about designing a system.",
    "The problem should be about a mathematical task needing automation.",
    "The problem should be about traffic or logistics.",
    "The problem should be about a city or a community.",
    "The problem should be about fiance or business.",
    "The problem should be about software or mobile applications.",
    "The problem should be about education or e-learning.",
    "The problem should be about e-commerce or online marketplaces.",
    "The problem should be about agriculture or food production.",
    "The problem should be about health or fitness.",
    "The problem should be about customer service.",
    "The problem should be about environmental sustainability.",
    "",
]
REAL_WORLD_CONTEXT = "The problem should be based on real world human activities."
MATH_CONTEXTS = [
    "The problem should be based on real world human activities but not a proof problem.",
    "The problem should a multi-choice problem but not a proof problem.",
    "The problem should be theoretical and mathematical but not a proof problem.",
    "The problem should be theoretical and mathematical but not a proof problem.",  # weighted twice upstream
]
PROBLEM_TAIL = (
    "\nWrite the problem after the **Problem** tag and the solution after the **Solution** tag. "
    "Do not write any explanation.\n"
)

TASK_TYPES = ("p2i", "i2ps", "p2ps", "ps2ps")


def task_instruction(task_type: str, domain: str, question_type: str) -> str:
    """The retrieval instruction (``task`` field). Upstream's p2i template read "Gievn"; fixed here."""
    templates = {
        "p2i": (f"Given a {question_type} problem, retrieve the relevant {domain} that help solve the given problem."),
        "p2ps": (
            f"Given a {question_type} problem, retrieve the relevant problems that can be solved by the "
            f"similar {domain}."
        ),
        "i2ps": (f"Given a {domain}, retrieve the relevant {question_type} problems that apply the given {domain}."),
        "ps2ps": (
            f"Given a problem with a solution, retrieve the relevant {question_type} problems that can be "
            f"solved by the similar {domain}."
        ),
    }
    if task_type not in templates:
        raise ValueError(f"unknown task_type {task_type!r}; expected one of {TASK_TYPES}")
    return templates[task_type]


CODING_DEFINITION_EXAMPLES = "\n".join(
    [
        "**Concept**",
        "Binary Search",
        "**Definition**",
        (
            "Binary Search is an efficient algorithm for finding a target value within a "
            "sorted array or list. It works by repeatedly dividing the search interval in "
            "half. If the value of the target is less than the middle element of the list, "
            "the algorithm continues the search on the left half, otherwise, it continues "
            "on the right half. This process is repeated until the target value is found "
            "or the interval is empty, which indicates that the target value is not "
            "present in the array."
        ),
        "**Implementation Code**",
        "```python",
        "def binary_search(arr, target):",
        "    left, right = 0, len(arr) - 1",
        "",
        "    while left <= right:",
        "        mid = left + (right - left) // 2",
        "        ",
        "        # Check if the target is present at mid",
        "        if arr[mid] == target:",
        "            return mid  # Target found at index mid",
        "        # If target is greater, ignore the left half",
        "        elif arr[mid] < target:",
        "            left = mid + 1",
        "        # If target is smaller, ignore the right half",
        "        else:",
        "            right = mid - 1",
        "",
        "    # Target not found",
        "    return -1",
        "```",
        "",
        "**Concept**",
        "Hash Set",
        "**Definition**",
        (
            "A Hash Set is a data structure that implements a collection of unique "
            "elements, designed to provide efficient operations for adding, removing, and "
            "checking for the existence of items. It uses a hash table to store the "
            "elements, which allows for average time complexity of O(1) for these "
            "operations. Each element is hashed to compute an index in an underlying "
            "array, where the element is stored. In the event of hash collisions, the "
            "structure typically employs techniques such as chaining or open addressing."
        ),
        "**Implementation Code**",
        "```python",
        "class HashSet:",
        "    def __init__(self):",
        "        self.size = 1000  # Initial size of the hash table",
        ("        self.table = [[] for _ in range(self.size)]  # Initialize hash table with empty lists"),
        "    ",
        "    def _hash(self, key):",
        "        return key % self.size  # Simple hash function",
        "",
        "    def add(self, key):",
        "        index = self._hash(key)",
        "        if key not in self.table[index]:  # Check for duplicates",
        "            self.table[index].append(key)  # Append key to the list at the hashed index",
        "",
        "    def remove(self, key):",
        "        index = self._hash(key)",
        "        if key in self.table[index]:",
        "            self.table[index].remove(key)  # Remove the key if it exists",
        "",
        "    def contains(self, key):",
        "        index = self._hash(key)",
        ("        return key in self.table[index]  # Return True if the key is found, otherwise False"),
        "```",
        "",
        "",
    ]
)

FORMULA_DEFINITION_EXAMPLES = "\n".join(
    [
        "**Concept**",
        "Pigeonhole Principle",
        "**Definition**",
        (
            "Let $S$ be a finite set whose cardinality is $n$. Let $S_1, S_2, \\ldots, S_k$ "
            "be a partition of $S$ into $k$ subsets. Then: :at least one subset $S_i$ of "
            "$S$ contains at least $\\ceiling {\\dfrac n k}$ elements where $\\ceiling {\\, "
            "\\cdot \\,}$ denotes the ceiling function."
        ),
        "",
        "**Concept**",
        "Newton's Second Law of Motion",
        "**Definition**",
        (
            "Newton's Second Law states that the force acting on an object is equal to the "
            "mass of the object multiplied by its acceleration. This law explains how the "
            "motion of an object changes when subjected to an external force. F = ma, "
            "\\quad \\text{where } F \\text{ is force (N), } m \\text{ is mass (kg), and } a "
            "\\text{ is acceleration (m/s}^2\\text{)}."
        ),
        "",
        "",
    ]
)


def definition_prompt(domain: str, instance: str, question_type: str) -> str:
    """Few-shot "Concept / Definition" prompt: code for coding concepts, LaTeX for formulas."""
    if question_type == "coding":
        head = f"Your task is to provide a definition for the {domain}: {instance} with the implementation code.\n\n"
        examples = CODING_DEFINITION_EXAMPLES
    else:
        head = (
            f"Your task is to provide a definition for the {domain}: {instance}. "
            "Write the equation in LaTex format.\n\n"
        )
        examples = FORMULA_DEFINITION_EXAMPLES
    return f"{head}Here are some examples:\n{examples}Here is your task:\n**Concept**\n{instance}\n**Definition**\n"


@dataclass(frozen=True)
class ProblemOptions:
    """The randomized parts of a problem prompt (context, difficulty reference, extra constraints)."""

    context: str = ""
    difficulty: str | None = None
    solved: str | None = None  # "in multiple steps" or "by multiple <domain>s"
    solution_no_mention: bool = False  # math only
    four_sentences: bool = False  # math only
    language: str = "Python"


def sample_problem_options(
    question_type: str, domain: str, references: list[str], rng: random.Random
) -> ProblemOptions:
    """Draw options with upstream's probabilities (same distribution, not the same random stream)."""

    def difficulty(p: float) -> str | None:
        return rng.choice(references) if references and rng.random() < p else None

    def solved() -> str | None:
        if rng.random() < 0.5:
            return "in multiple steps" if rng.random() < 0.7 else f"by multiple {domain}s"
        return None

    if question_type == "coding":
        return ProblemOptions(context=rng.choice(CODING_CONTEXTS), difficulty=difficulty(0.6))
    if question_type == "math":
        return ProblemOptions(
            context=rng.choice(MATH_CONTEXTS),
            difficulty=difficulty(0.8),
            solved=solved(),
            solution_no_mention=rng.random() < 0.5,
            four_sentences=rng.random() < 0.4,
        )
    context = REAL_WORLD_CONTEXT if rng.random() < 0.5 else ""
    return ProblemOptions(context=context, difficulty=difficulty(0.6), solved=solved())


def problem_prompt(question_type: str, domain: str, instance: str, opts: ProblemOptions) -> str:
    """User prompt asking for one new problem + solution that needs ``instance`` without naming it."""
    context = f"\n{opts.context}" if opts.context else ""
    p = f"Your task is to create one {question_type} problem with a correct solution.\n"
    p += f"The problem should be new and unique, not similar to common existing problems.{context}\n"
    if question_type == "math":
        p += "The problem should involve numerical operations.\n"
    p += (
        f"Most importantly, the problem should require or test about the {domain}: {instance}.\n"
        f"The problem should not explicitly mentioning {instance}.\n"
    )
    if question_type == "coding":
        if opts.difficulty:
            p += f"The problem should be as difficult as {opts.difficulty}.\n"
        p += f"The solution code should be written in the programming language {opts.language}.\n"
        return p + PROBLEM_TAIL
    if question_type != "math":
        p += "The problem should involve numerical operations.\n"
    p += "The problem should ask for only one answer.\n"
    if opts.difficulty:
        p += f"The problem should be as difficult as {opts.difficulty}.\n"
    if opts.solved:
        p += f"The problem should be solved {opts.solved}.\n"
    if opts.solution_no_mention:
        p += f"The solution should not explicitly mention {instance}.\n"
    if opts.four_sentences:
        p += "The problem should be around four sentences long.\n"
    p += "The solution should include reasoning or calculation steps.\n"
    return p + PROBLEM_TAIL


def problem_check_prompt(domain: str, instance: str) -> str:
    """Follow-up turn after the generated pair: confirm the concept, or ask for a replacement pair."""
    return (
        f'Is this problem testing or requiring {domain} {instance}? If yes, please answer "YES". If no, '
        f"please response with a new problem and solution about {instance} with similar context and "
        "difficulty. Do not provide any explanation."
    )


def solution_check_prompt(question_type: str, domain: str, instance: str, problem: str, solution: str) -> str:
    """Verifier prompt: YES/No for formulas; for code, a rewritten solution with a docstring or "NO"."""
    head = f"**Problem**\n{problem}\n**Solution**\n{solution}\n\n"
    if question_type == "coding":
        return head + (
            f"Is this a correct solution to the problem and using the {domain} {instance}? If yes, response "
            "with the the updated Python solution code, including a docstring that contains the problem "
            'description, as well as the input and output specifications. If no, response "NO".'
        )
    return head + (
        f'Is this a correct solution to the problem and using the {domain} {instance}? Response "YES" or "No".'
    )


def negative_prompt(instruction: str, domain: str, instance: str, query: str, positive: str) -> str:
    """Ask the LLM to write a hard negative: same context and format, different concept."""
    return (
        f"You have been assigned a retrieval task: {instruction}\n"
        "You will be given a user query and a positive document. Your mission is to write one hard negative "
        "document. The hard negative document must:\n"
        f"- Have the similar context background as the user query but test or require a different {domain}.\n"
        "- Follow the format of the positive document.\n"
        f"- Should not be related to {instance}.\n"
        "- Should not be helpful for solving the user query problem.\n\n"
        f"**User Query**\n{query}\n\n**Positive Document**\n{positive}\n\n"
        "Directly response the content of hard negative document.\n**Hard Negative Document**\n"
    )


def render_prompt_card() -> str:
    """Markdown listing of every template (``ReasonAug/prompts.md`` is this text; a test keeps them equal)."""

    def block(text: str) -> str:
        return "````text\n" + text + ("" if text.endswith("\n") else "\n") + "````"

    full = ProblemOptions(
        context="{context}", difficulty="{reference}", solved="{in multiple steps | by multiple {domain}s}"
    )
    math = ProblemOptions(
        context="{context}",
        difficulty="{reference}",
        solved="{in multiple steps | by multiple {domain}s}",
        solution_no_mention=True,
        four_sentences=True,
    )
    parts = [
        "# ReasonAug prompt templates",
        "",
        "Generated by `python -m diffusion_embedder.reasonaug prompts` from "
        "`diffusion_embedder/reasonaug/prompts.py`; do not edit by hand. Placeholders in braces. "
        "Optional lines are drawn per request (probabilities below).",
        "",
        "## 1. Definitions (system: " + f"`{DEFINITION_SYSTEM}`, max_tokens {DEFINITION_MAX_TOKENS})",
        "",
        "Coding concepts (algorithm, data structure):",
        "",
        block(definition_prompt("{domain}", "{instance}", "coding")),
        "",
        "Formula concepts (math, physics, finance):",
        "",
        block(definition_prompt("{domain}", "{instance}", "math")),
        "",
        f"## 2. Problem / solution pairs (system: `{PROBLEM_SYSTEM}`, max_tokens {PROBLEM_MAX_TOKENS})",
        "",
        "Coding: `{context}` is one of the 17 options below, chosen uniformly (one is empty: no line); the "
        "difficulty line appears with probability 0.6.",
        "",
        block(problem_prompt("coding", "{domain}", "{instance}", full)),
        "",
        "Physics and finance: context = the real-world sentence with probability 0.5; difficulty 0.6; "
        '"solved" line 0.5 (then "in multiple steps" 0.7, "by multiple {domain}s" 0.3).',
        "",
        block(problem_prompt("physics", "{domain}", "{instance}", full)),
        "",
        "Math: context uniform over the math options (the theoretical one counted twice); difficulty 0.8; "
        '"solved" 0.5; "solution should not mention" 0.5; "four sentences" 0.4.',
        "",
        block(problem_prompt("math", "{domain}", "{instance}", math)),
        "",
        "Coding contexts:",
        "",
        *[f"- `{c}`" if c else "- (none)" for c in CODING_CONTEXTS],
        "",
        "Math contexts:",
        "",
        *[f"- `{c}`" for c in dict.fromkeys(MATH_CONTEXTS)],
        "",
        "Difficulty references:",
        "",
        *[f"- {domain}: " + "; ".join(refs) for domain, refs in DIFFICULTY_REFERENCES.items()],
        "",
        "## 3. Problem check (appended to the generating conversation)",
        "",
        block(problem_check_prompt("{domain}", "{instance}")),
        "",
        f"## 4. Solution check (system: `{SOLUTION_CHECK_SYSTEM}`)",
        "",
        "Coding:",
        "",
        block(solution_check_prompt("coding", "{domain}", "{instance}", "{problem}", "{solution}")),
        "",
        "Math, physics, finance:",
        "",
        block(solution_check_prompt("math", "{domain}", "{instance}", "{problem}", "{solution}")),
        "",
        f"## 5. LLM-written hard negatives (optional stage; system: `{NEGATIVE_SYSTEM}`)",
        "",
        block(negative_prompt("{task}", "{domain}", "{instance}", "{user_query}", "{positive_document}")),
        "",
        "## 6. Retrieval instructions (`task` field)",
        "",
        *[f"- `{t}`: `{task_instruction(t, '{domain}', '{question_type}')}`" for t in TASK_TYPES],
        "",
        'Upstream\'s p2i template began with the typo "Gievn"; it is fixed here.',
        "",
    ]
    return "\n".join(parts)
