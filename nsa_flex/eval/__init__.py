"""Evaluation of trained checkpoints: passkey / multi-key needle retrieval (`needle`), its prompts
and scores (`prompts`), summaries, heatmaps and the ablation table (`report`).

    python -m nsa_flex.eval --quick --out /tmp/needle_quick      # CLI: see nsa_flex/eval/needle.py
"""
