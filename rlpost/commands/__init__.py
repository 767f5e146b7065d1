"""The commands' drivers that sit beside the RL loop rather than in it: ``rlpost sft`` on
conversations, ``rlpost dpo`` and ``rlpost rm`` (:mod:`rlpost.commands.offline`)."""
