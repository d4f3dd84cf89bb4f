"""Capitals: a two-module program a 135M pretrained LM gets partly right, for the real-LM tier.

`country` reads a question and names the country it asks about; `capital` names that country's
capital city. Both are bare predictors (the reply is the field's value alone: SmolLM2-135M does
not follow the headed format), and both reply in several tokens. The reward grades the final
reply: 1 for the capital's name alone, 0.5 for a reply that contains it among other words ("The
capital of Iceland is Reykjavik."), 0 otherwise, after light normalisation. The pretrained model
starts between 0 and 1: it knows many capitals but wraps them in sentences (an exact match alone
scored 0 of 60 greedy replies), names the country where the city belongs, or guesses.

Data: 120 countries and their capitals, written here (public facts). Each country gets one
question from a few phrasings. Splits (seeded by `seed`): 60 train, 30 dev, 30 test, by
country, so the held-out splits ask about countries training never saw.
"""

from __future__ import annotations

import random

from mmgrpo_jax.program import Example, Module, Predict, Prediction
from programs.data import Splits
from programs.text import ascii_folded, phrase

CAPITALS = {
    "Afghanistan": "Kabul", "Albania": "Tirana", "Algeria": "Algiers", "Argentina": "Buenos Aires",
    "Armenia": "Yerevan", "Australia": "Canberra", "Austria": "Vienna", "Azerbaijan": "Baku",
    "Bangladesh": "Dhaka", "Belarus": "Minsk", "Belgium": "Brussels", "Bolivia": "Sucre",
    "Brazil": "Brasilia", "Bulgaria": "Sofia", "Cambodia": "Phnom Penh", "Cameroon": "Yaounde",
    "Canada": "Ottawa", "Chile": "Santiago", "China": "Beijing", "Colombia": "Bogota",
    "Croatia": "Zagreb", "Cuba": "Havana", "Cyprus": "Nicosia", "Czechia": "Prague",
    "Denmark": "Copenhagen", "Ecuador": "Quito", "Egypt": "Cairo", "Estonia": "Tallinn",
    "Ethiopia": "Addis Ababa", "Finland": "Helsinki", "France": "Paris", "Georgia": "Tbilisi",
    "Germany": "Berlin", "Ghana": "Accra", "Greece": "Athens", "Guatemala": "Guatemala City",
    "Hungary": "Budapest", "Iceland": "Reykjavik", "India": "New Delhi", "Indonesia": "Jakarta",
    "Iran": "Tehran", "Iraq": "Baghdad", "Ireland": "Dublin", "Italy": "Rome",
    "Jamaica": "Kingston", "Japan": "Tokyo", "Jordan": "Amman", "Kazakhstan": "Astana",
    "Kenya": "Nairobi", "Kuwait": "Kuwait City", "Laos": "Vientiane", "Latvia": "Riga",
    "Lebanon": "Beirut", "Libya": "Tripoli", "Lithuania": "Vilnius", "Luxembourg": "Luxembourg",
    "Madagascar": "Antananarivo", "Malaysia": "Kuala Lumpur", "Mali": "Bamako", "Malta": "Valletta",
    "Mexico": "Mexico City", "Mongolia": "Ulaanbaatar", "Morocco": "Rabat",
    "Mozambique": "Maputo", "Nepal": "Kathmandu", "Netherlands": "Amsterdam",
    "New Zealand": "Wellington", "Nicaragua": "Managua", "Nigeria": "Abuja", "Norway": "Oslo",
    "Oman": "Muscat", "Pakistan": "Islamabad", "Panama": "Panama City", "Paraguay": "Asuncion",
    "Peru": "Lima", "Philippines": "Manila", "Poland": "Warsaw", "Portugal": "Lisbon",
    "Qatar": "Doha", "Romania": "Bucharest", "Russia": "Moscow", "Rwanda": "Kigali",
    "Saudi Arabia": "Riyadh", "Senegal": "Dakar", "Serbia": "Belgrade", "Singapore": "Singapore",
    "Slovakia": "Bratislava", "Slovenia": "Ljubljana", "Somalia": "Mogadishu",
    "South Africa": "Pretoria", "South Korea": "Seoul", "Spain": "Madrid", "Sri Lanka": "Colombo",
    "Sudan": "Khartoum", "Sweden": "Stockholm", "Switzerland": "Bern", "Syria": "Damascus",
    "Tanzania": "Dodoma", "Thailand": "Bangkok", "Tunisia": "Tunis",
    "Turkey": "Ankara", "Uganda": "Kampala", "Ukraine": "Kyiv", "United Kingdom": "London",
    "United States": "Washington", "Uruguay": "Montevideo", "Uzbekistan": "Tashkent",
    "Venezuela": "Caracas", "Vietnam": "Hanoi", "Yemen": "Sanaa", "Zambia": "Lusaka",
    "Zimbabwe": "Harare", "North Korea": "Pyongyang", "Honduras": "Tegucigalpa",
    "El Salvador": "San Salvador", "Costa Rica": "San Jose", "Dominican Republic": "Santo Domingo",
    "Angola": "Luanda", "Namibia": "Windhoek", "Botswana": "Gaborone",
}  # fmt: skip
PHRASINGS = (
    "What is the capital of {country}?",
    "Which city is the capital of {country}?",
    "Name the capital city of {country}.",
    "In which city is the government of {country} based?",
)
TRAIN_SIZE, DEV_SIZE = 60, 30


def load_capitals(seed: int = 0) -> Splits:
    """Seeded splits by country: train 60, dev 30, test 30 (see the module docstring)."""
    rng = random.Random(seed)
    countries = sorted(CAPITALS)
    rng.shuffle(countries)
    examples = [
        Example(
            question=rng.choice(PHRASINGS).format(country=country),
            country=country,
            capital=CAPITALS[country],
        ).with_inputs("question")
        for country in countries
    ]
    train, rest = examples[:TRAIN_SIZE], examples[TRAIN_SIZE:]
    return Splits(train=train, dev=rest[:DEV_SIZE], test=rest[DEV_SIZE:])


class Capitals(Module):
    """question -> country -> capital, two bare predictors."""

    def __init__(self) -> None:
        self.country = Predict(
            "question -> country",
            instructions="Name the country that the question asks about.",
            bare=True,
        )
        self.capital = Predict(
            "country -> capital",
            instructions="Name the capital city of the country. Reply with the city name only.",
            bare=True,
        )

    def forward(self, question: str) -> Prediction:
        country = self.country(question=question).country
        return self.capital(country=country)


def normalize(text: str) -> str:
    """Lower case, accents and punctuation off, spaces collapsed: 'Bogotá.' -> 'bogota'."""
    return phrase(ascii_folded(text))


def capital_match(example: Example, prediction: Prediction) -> float:
    """1 for the capital alone, 0.5 for the capital inside a longer reply, else 0 (normalized)."""
    reply, capital = normalize(str(prediction.capital)), normalize(example.capital)
    if reply == capital:
        return 1.0
    return 0.5 if f" {capital} " in f" {reply} " else 0.0
