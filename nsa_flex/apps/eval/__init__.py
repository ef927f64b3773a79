"""Evaluation of trained checkpoints: passkey / multi-key needle retrieval (`needle`), its prompts
and scores (`prompts`), loss by token position (`position_loss`), top-n selection statistics and
traces (`selection_stats`), held-out documents (`docs`), summaries and figures (`report`), the options the
tasks share (`cli`).

    python -m nsa_flex.eval --quick --out /tmp/needle_quick                       # needle (default task)
    python -m nsa_flex.eval --task position-loss --quick --out /tmp/posloss
    python -m nsa_flex.eval --task selection --quick --out /tmp/selection
"""
