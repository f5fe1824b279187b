"""The planner's measuring half: it runs ranks, so it sits above train, launch and bench.

`calibrate` measures this machine into the profile the planner reads (`probe` on each rank,
`fit` to turn points into parameters, `runs` for what is run); `verify` trains plans for real
and compares them with the planner's predictions (`verify_cli`: the command), on verify's
GPT or any model `meshtrain train` builds (`trained_model`); `ranking` checks the advisor's
order of plans against the measured one. The pure models it checks live in `meshtrain.planner`.
"""
